"""Public names of method families shown in the shared namespaces (issue 41 item 2, ``keras_mone.exports``).

A family's folder sits above ``keras_mone.models`` / ``keras_mone.layers``;
its public classes must still be reachable where they always were, with
nothing in those packages importing the families."""

import pytest

import keras_mone
from keras_mone import analysis, exports, layers, models

#: Every name the README, docs and bench scripts use from a shared namespace, by family.
FAMILY_NAMES = {
    "keras_mone.models": [
        "MoNEViTBackbone", "MoNEViViTBackbone", "MatViTBackbone", "MatViViTBackbone", "MatViTClassifier",
        "MatViViTClassifier", "MoDViTBackbone", "AMoDViTBackbone", "MoDViViTBackbone", "AMoDViViTBackbone",
        "MixerBackbone", "SparseMLPBackbone", "SparseMLPClassifier", "MIXER_SIZES", "SPARSE_MLP_SIZES",
        "sparse_mlp_from_mixer", "ACMViTBackbone", "acm_from_dense",
    ],
    "keras_mone.layers": [
        "ACMGate", "ACMLinear", "ACMMLP", "MixerBlock", "MlpBlock", "SparseMixerBlock", "ReRepresent1",
        "ReRepresent2", "SparseMoE",
    ],
    "keras_mone.analysis": ["merged_gmacs", "merging_tokens", "token_merging_sweep"],
}
NAMESPACES = {"keras_mone.models": models, "keras_mone.layers": layers, "keras_mone.analysis": analysis}


@pytest.mark.parametrize("namespace", sorted(FAMILY_NAMES))
def test_family_names_resolve_where_they_always_were(namespace):
    module = NAMESPACES[namespace]
    for name in FAMILY_NAMES[namespace]:
        value = getattr(module, name)
        assert value is exports.exported(namespace)[name]
        assert name in dir(module)
    # `from ... import` goes through the same module __getattr__
    namespace_globals = {}
    exec(f"from {namespace} import {FAMILY_NAMES[namespace][0]}", namespace_globals)
    assert namespace_globals[FAMILY_NAMES[namespace][0]] is getattr(module, FAMILY_NAMES[namespace][0])


def test_the_shared_packages_do_not_import_the_families():
    # What is defined in models/ and layers/ themselves lives there; the
    # family classes come only from their folders (the floor test checks imports).
    assert models.ViTBackbone.__module__ == "keras_mone.models.vit_backbone"
    assert models.MoNEViTBackbone.__module__ == "keras_mone.methods.mone.backbone"
    assert layers.ACMGate.__module__ == "keras_mone.methods.acm.gate"
    assert "MoNEViTBackbone" not in vars(models) and "ACMGate" not in vars(layers)


def test_an_unknown_name_is_the_usual_attribute_error():
    with pytest.raises(AttributeError, match="module 'keras_mone.models' has no attribute 'NoSuchBackbone'"):
        models.NoSuchBackbone
    assert not hasattr(layers, "NoSuchLayer")
    with pytest.raises(ImportError):
        exec("from keras_mone.models import NoSuchBackbone", {})


def test_two_families_cannot_claim_one_public_name():
    class Impostor:
        pass

    with pytest.raises(ValueError, match=r"keras_mone.models.MoNEViTBackbone is already exported"):
        exports.export("keras_mone.models", name="MoNEViTBackbone")(Impostor)
    assert models.MoNEViTBackbone is not Impostor
    assert exports.export("keras_mone.models")(models.MoNEViTBackbone) is models.MoNEViTBackbone  # same object: fine
    with pytest.raises(ValueError, match="`namespaces` must be one or more 'keras_mone...' module names"):
        exports.export("models")(Impostor)


def test_the_facade_loads_every_family():
    assert {"mone_vit", "matvit", "mod_vit", "amod_vit", "mixer", "sparse_mlp", "acm_vit"} <= set(
        keras_mone.methods.ARCHITECTURES
    )
