"""Models the planner knows by name. Parameter counts and forward multiply-accumulates per 224x224 image are
torchvision's (`torchvision/models/resnet.py`, `vgg.py`: the weights' `num_params` and `_ops` metadata;
`_ops` counts multiply-accumulates in GFLOPS' place). Training FLOPs per sample = 6 x forward MACs (2 FLOPs
per MAC, backward twice the forward). BERT-Large: 340 M parameters (Devlin et al., arXiv:1810.04805, Table 1
footnote), 6 x parameters FLOPs per token (Kaplan et al., arXiv:2001.08361) at sequence length 128 (BERT's
first pre-training phase), attention's own FLOPs left out."""

from __future__ import annotations

from dtrain.plan.spec import TRAINING_FLOPS_PER_FORWARD_MAC, ModelSpec

TORCHVISION = "torchvision weights metadata (num_params, _ops)"


def _vision(name: str, parameters: int, forward_gmacs: float) -> ModelSpec:
    return ModelSpec(name=name, parameters=parameters,
                     training_flops_per_sample=TRAINING_FLOPS_PER_FORWARD_MAC * forward_gmacs * 1e9,
                     source=f"{TORCHVISION}: {parameters:,} parameters, {forward_gmacs} GMACs per 224x224 image")


BERT_LARGE_SEQUENCE_LENGTH = 128

MODELS: dict[str, ModelSpec] = {
    "resnet50": _vision("resnet50", 25_557_032, 4.089),
    "resnet101": _vision("resnet101", 44_549_160, 7.801),
    "resnet152": _vision("resnet152", 60_192_808, 11.514),
    "vgg16": _vision("vgg16", 138_357_544, 15.47),
    "bert-large": ModelSpec(
        name="bert-large", parameters=340_000_000,
        training_flops_per_sample=6 * 340e6 * BERT_LARGE_SEQUENCE_LENGTH,
        source="Devlin et al. 2019 (340 M parameters); 6 FLOPs per parameter per token (Kaplan et al. 2020), "
               f"{BERT_LARGE_SEQUENCE_LENGTH} tokens per sample"),
}


def model_preset(name: str) -> ModelSpec:
    """A preset by name (case and dashes/underscores ignored)."""
    key = name.lower().replace("_", "-")
    key = {"resnet-50": "resnet50", "resnet-101": "resnet101", "resnet-152": "resnet152", "vgg-16": "vgg16",
           "bert": "bert-large", "bertlarge": "bert-large"}.get(key, key)
    if key not in MODELS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(MODELS)}")
    return MODELS[key]


__all__ = ["MODELS", "model_preset"]
