"""Backend kernels beside the plain ``keras.ops`` paths they equal (issue 40).

``fused_nested_mlp``: a MoNE token group's nested MLP as one Pallas kernel (jax),
chosen with ``$KERAS_MONE_MLP=fused`` (``layers.platform_forms.mlp_form``).
"""
