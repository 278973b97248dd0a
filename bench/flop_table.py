"""Analytic MACs of the zoo's ViTs against the published figures, and MoNE ratios.

    python bench/flop_table.py            # prints a markdown table
"""

import keras_mone
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone, decode_variant

PUBLISHED_GMACS = {"Ti/16": 1.26, "S/16": 4.61, "B/16": 17.58, "L/16": 61.6}


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


if __name__ == "__main__":
    main()
