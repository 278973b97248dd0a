"""Analytic MACs of the zoo's ViTs and ViViTs against the published figures, and MoNE ratios.

    python bench/flop_table.py            # prints a markdown table
"""

import keras_mone
from keras_mone.models import (
    ImageClassifier,
    MoNEViTBackbone,
    MoNEViViTBackbone,
    VideoClassifier,
    ViTBackbone,
    ViViTBackbone,
    decode_variant,
)

PUBLISHED_GMACS = {"Ti/16": 1.26, "S/16": 4.61, "B/16": 17.58, "L/16": 61.6}
# ViViT-FE-B/16 (reference-facts.md): ~283 GMACs at 32x224x224, ~374 at 32x256x256
# (the MoNE paper's Table 1 quotes 376 GFLOPs for the dense model and 162 for MoNE at e_c 0.3).
PUBLISHED_VIVIT_GMACS = {224: 283, 256: 374}


def classifier(backbone_cls, variant, **kwargs):
    backbone = backbone_cls(**decode_variant(variant), use_class_token=True, **kwargs)
    return ImageClassifier(backbone, num_classes=1000, pooling="token")


def main():
    print("| model | GMACs (keras_mone) | published | difference |")
    print("|---|---|---|---|")
    for variant, published in PUBLISHED_GMACS.items():
        gmacs = keras_mone.flops(classifier(ViTBackbone, variant)).gmacs
        print(f"| ViT-{variant} | {gmacs:.3f} | {published} | {100 * (gmacs / published - 1):+.2f}% |")
    print()
    print("| MoNE-ViT-B/16, e_c | tokens per expert (D/8..D) | GMACs | dense / MoNE |")
    print("|---|---|---|---|")
    dense = keras_mone.flops(classifier(ViTBackbone, "B/16")).total
    for capacity in (0.2, 0.3, 0.5, 0.75, 1.0):
        model = classifier(MoNEViTBackbone, "B/16", capacity=capacity)
        count = keras_mone.flops(model)
        counts, _ = model.backbone.expert_token_counts()
        print(f"| {capacity} | {list(counts)} | {count.gmacs:.2f} | {dense / count.total:.2f}x |")

    print()
    print("| ViViT-FE-B/16, 32 frames | dense GMACs | published | MoNE e_c 0.3 GMACs | dense / MoNE | MoNE e_c 0.5 | dense / MoNE |")
    print("|---|---|---|---|---|---|---|")
    for size, published in PUBLISHED_VIVIT_GMACS.items():
        dense = keras_mone.flops(video_classifier(ViViTBackbone, size)).total
        row = f"| {size}x{size} | {dense / 1e9:.1f} | {published} ({100 * (dense / 1e9 / published - 1):+.2f}%)"
        for capacity in (0.3, 0.5):
            mone = keras_mone.flops(video_classifier(MoNEViViTBackbone, size, capacity=capacity)).total
            row += f" | {mone / 1e9:.1f} | {dense / mone:.2f}x"
        print(row + " |")


def video_classifier(backbone_cls, image_size, **kwargs):
    backbone = backbone_cls(**decode_variant("B/16"), image_size=image_size, num_frames=32, **kwargs)
    return VideoClassifier(backbone, num_classes=400)


if __name__ == "__main__":
    main()
