"""Backend kernels beside the plain ``keras.ops`` paths they equal (issue 40).

* ``fused_nested_mlp``: a MoNE token group's nested MLP as one Pallas kernel (jax);
* ``fused_residual_mlp``: a block's whole MLP half for a nested group (LayerNorm,
  nested MLP, gate scale, residual) as one Pallas kernel (jax);
* ``grouped_projection``: a nested projection over all of a block's token groups as one
  Pallas kernel (jax; ``$KERAS_MONE_PROJECTIONS=grouped_kernel``, ``layers.grouped_block``);
* ``grouped_gradients``: the training step's dX and dW (and db) of those projections over
  all token groups (jax);
* ``flash_attention``: softmax attention as one Pallas kernel that never writes the scores
  (jax, any float dtype; ``$KERAS_MONE_ATTENTION=flash``);
* ``row_statistics``: a LayerNorm's row mean and rstd as one Pallas kernel (jax;
  ``$KERAS_MONE_STATISTICS=kernel``), for the grouped kernels' LayerNorm prologues;
* ``triton_nested_mlp``: a nested group's MLP as one Triton kernel (torch);
* ``triton_grouped_projection`` (launch: ``triton_grouped_launch``; program:
  ``triton_grouped_tile``) and ``triton_row_statistics``: torch's twins of
  ``grouped_projection`` and ``row_statistics`` (``$KERAS_MONE_PROJECTIONS=grouped_kernel`` on
  torch, ``layers.packed_kernels``), the LayerNorms' statistics mostly from the out-projections'
  per-tile partials (``TilePartials``);
* ``precision``: the Pallas kernels' products at jax's ``default_matmul_precision``;
  ``tiles``: the fused MLP kernels' tile defaults.

``$KERAS_MONE_MLP=fused`` (``layers.platform_forms.mlp_form``) runs a ``ViTBlock``'s
nested groups through ``fused_residual_mlp``, ``$KERAS_MONE_MLP=mlp_kernel`` through
``fused_nested_mlp`` (the LayerNorm and residual stay XLA's): compiled through Pallas'
Triton lowering on a GPU, interpreted elsewhere (exact and slow: for tests).
``cuda_lowering`` shows what a GPU would be given, without one; ``bench/roofline.py``
models what they save, ``bench/kernel_compile.py`` reports what the GPU compiler makes
of them (registers, spills, work per hidden element), ``bench/gpu.sh`` times them.
"""
