"""The built-in profiles: architectures (``architectures.py``) timed by a FLOP-based
estimate on a reference GPU.

The estimate, for every built-in: a layer's forward time is its forward FLOPs for the
reference batch divided by the reference device's effective throughput, and its backward
time is twice that (the gradients with respect to both inputs and weights, each about one
forward's FLOPs). One efficiency for every layer is a simplification: it stands for the
element-wise work the FLOP counts leave out as much as for kernel efficiency.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sumflow.profiles import architectures
from sumflow.profiles.architectures import ArchLayer
from sumflow.profiles.format import LayerProfile, ModelProfile

#: Backward FLOPs per forward FLOP.
BACKWARD_FACTOR = 2.0


@dataclass(frozen=True)
class ReferenceDevice:
    """A GPU the built-in times are estimated for: its peak throughput and the fraction
    of it that training sustains."""

    name: str
    peak_tflops: float
    efficiency: float

    @property
    def effective_flops_per_s(self) -> float:
        """FLOP/s assumed sustained."""
        return self.peak_tflops * 1e12 * self.efficiency

    def milliseconds(self, flops: float) -> float:
        """Time for `flops` at the effective throughput."""
        return flops / self.effective_flops_per_s * 1e3

    def describe(self) -> str:
        """e.g. ``NVIDIA V100 SXM2, FP32 (15.7 TFLOP/s peak x 0.55 = 8.6 TFLOP/s)``."""
        return (
            f"{self.name} ({self.peak_tflops:g} TFLOP/s peak x {self.efficiency:g} = "
            f"{self.effective_flops_per_s / 1e12:.2f} TFLOP/s)"
        )


#: V100 SXM2's FP32 peak is 15.7 TFLOP/s. 55% of it makes ResNet-50 (3 x 8.2 GFLOPs per
#: image per iteration) train at about 350 images/s, in line with published FP32 V100
#: ResNet-50 training throughputs of 350-400 images/s.
V100 = ReferenceDevice("NVIDIA V100 SXM2, FP32", 15.7, 0.55)

#: Reference batch per worker (BytePS and Horovod benchmarks' common per-GPU batch).
CNN_BATCH = 32
#: Reference batch for the Transformer: sentence pairs of 128 + 128 tokens, i.e. 4,096
#: source and 4,096 target tokens per worker per iteration (the paper's batches were about
#: 25,000 + 25,000 tokens over 8 GPUs, 3,100 per GPU).
TRANSFORMER_BATCH = 32
TRANSFORMER_SEQ_LEN = 128


def profile_from_architecture(
    name: str,
    layers: Sequence[ArchLayer],
    *,
    device: ReferenceDevice,
    batch_size: int,
    sample: str,
    source: str,
) -> ModelProfile:
    """Times `layers` for `batch_size` samples on `device` (forward = FLOPs / effective
    throughput, backward = :data:`BACKWARD_FACTOR` x forward) and appends the timing
    assumptions and totals to `source`."""
    total_flops = sum(layer.flops for layer in layers)
    timed = []
    for layer in layers:
        # Rounded to the nanosecond so the JSON stays readable; far below sleep accuracy.
        fwd = round(device.milliseconds(layer.flops * batch_size), 6)
        timed.append(LayerProfile(layer.name, layer.params, fwd, round(fwd * BACKWARD_FACTOR, 6)))
    fwd_ms = device.milliseconds(total_flops * batch_size)
    timing = (
        f" Times: forward FLOPs per sample {total_flops / 1e9:.3f} G (multiply-add = 2 FLOPs; "
        f"convolutions, linear layers and attention products only) x batch {batch_size} / "
        f"{device.describe()} = {fwd_ms:.1f} ms forward; backward = "
        f"{BACKWARD_FACTOR:g} x forward per layer."
    )
    return ModelProfile(
        name=name,
        source=source + timing,
        device=device.name,
        batch_size=batch_size,
        sample=sample,
        layers=tuple(timed),
    )


def vgg16() -> ModelProfile:
    """VGG-16 at 224x224, batch 32, on a V100 (see :func:`architectures.vgg16`)."""
    return profile_from_architecture(
        "vgg16",
        architectures.vgg16(),
        device=V100,
        batch_size=CNN_BATCH,
        sample="image 3x224x224, 1000 classes",
        source=(
            "Sizes: torchvision vgg16() (Simonyan & Zisserman 2015, configuration D, no "
            "batch norm), derived in sumflow/profiles/architectures.py: 13 convolutions "
            "and 3 linear layers, 32 tensors, 138,357,544 parameters; one layer per "
            "convolution or linear layer."
        ),
    )


def resnet50() -> ModelProfile:
    """ResNet-50 at 224x224, batch 32, on a V100 (see :func:`architectures.resnet50`)."""
    return profile_from_architecture(
        "resnet50",
        architectures.resnet50(),
        device=V100,
        batch_size=CNN_BATCH,
        sample="image 3x224x224, 1000 classes",
        source=(
            "Sizes: torchvision resnet50() (He et al. 2016, v1.5: stride on the 3x3 "
            "convolution), derived in sumflow/profiles/architectures.py: 161 tensors, "
            "25,557,032 parameters; one layer per convolution with its batch norm, plus fc."
        ),
    )


def transformer() -> ModelProfile:
    """Transformer-base, 128+128 tokens, batch 32 pairs, on a V100 (see
    :func:`architectures.transformer_base`)."""
    return profile_from_architecture(
        "transformer",
        architectures.transformer_base(src_len=TRANSFORMER_SEQ_LEN, tgt_len=TRANSFORMER_SEQ_LEN),
        device=V100,
        batch_size=TRANSFORMER_BATCH,
        sample=(
            f"sentence pair of {TRANSFORMER_SEQ_LEN} source + {TRANSFORMER_SEQ_LEN} target tokens"
        ),
        source=(
            "Sizes: Transformer-base of Vaswani et al. 2017 (d_model 512, 8 heads, ffn "
            "2048, 6 encoder + 6 decoder post-norm layers) as fairseq's transformer_wmt_en_de "
            "with share_all_embeddings, derived in sumflow/profiles/architectures.py: "
            "q/k/v/out projections and feed-forward layers with biases, layer norms, one "
            "37,000 x 512 token embedding shared by encoder, decoder and output projection, "
            "sinusoidal positions (no parameters), no output bias: 253 tensors, 63,082,496 "
            "parameters (the paper rounds to 65M). Layers: the embedding, then each "
            "attention and feed-forward sublayer with its layer norm, then the output "
            f"projection (no tensor of its own). Sequence length {TRANSFORMER_SEQ_LEN} for "
            "source and target; attention FLOPs include the seq^2 products."
        ),
    )


#: BERT-large at pre-training phase 1: 32 sequences of 128 tokens per worker.
BERT_BATCH = 32
BERT_SEQ_LEN = 128
#: GPT-2: 8 sequences of its full 1,024-token context per worker.
GPT2_BATCH = 8
GPT2_SEQ_LEN = 1024


def bert_large() -> ModelProfile:
    """BERT-large pre-training, 128-token sequences, batch 32, on a V100 (see
    :func:`architectures.bert_large`)."""
    return profile_from_architecture(
        "bert-large",
        architectures.bert_large(seq_len=BERT_SEQ_LEN),
        device=V100,
        batch_size=BERT_BATCH,
        sample=f"sequence of {BERT_SEQ_LEN} tokens (WordPiece, 30,522-token vocabulary)",
        source=(
            "Sizes: BERT-large (Devlin et al. 2019: hidden 1024, 16 heads, ffn 4096, 24 "
            "post-norm layers, 512 positions, 2 segment types) as Hugging Face's "
            "BertForPreTraining, derived in sumflow/profiles/architectures.py: pooler, "
            "masked-LM head (dense transform with layer norm, decoder tied to the word "
            "embeddings, its own bias) and next-sentence head; 398 tensors, 336,226,108 "
            "parameters (335,141,888 without the heads). Layers: the embeddings, each "
            "attention and feed-forward sublayer with its layer norm, then the pooler and "
            f"the heads. Sequence length {BERT_SEQ_LEN} (pre-training phase 1); the "
            "masked-LM decoder projects every token; attention FLOPs include the seq^2 "
            "products."
        ),
    )


def gpt2() -> ModelProfile:
    """GPT-2 (124M), 1,024-token sequences, batch 8, on a V100 (see
    :func:`architectures.gpt2`)."""
    return profile_from_architecture(
        "gpt2",
        architectures.gpt2(seq_len=GPT2_SEQ_LEN),
        device=V100,
        batch_size=GPT2_BATCH,
        sample=f"sequence of {GPT2_SEQ_LEN} tokens (byte-level BPE, 50,257-token vocabulary)",
        source=(
            "Sizes: GPT-2 small (Radford et al. 2019: width 768, 12 heads, ffn 3072, 12 "
            "pre-norm blocks, 1024 positions) as Hugging Face's GPT2LMHeadModel, derived in "
            "sumflow/profiles/architectures.py: Conv1D projections (in x out) with biases, "
            "layer norms, a final layer norm, and an LM head tied to the token embedding "
            "(no tensor of its own); 148 tensors, 124,439,808 parameters. Layers: the "
            "embeddings, each block's attention and MLP with their layer norms, ln_f, then "
            f"the LM head. Sequence length {GPT2_SEQ_LEN}; attention FLOPs include the "
            "seq^2 products over the full matrices."
        ),
    )


_BUILTINS: dict[str, Callable[[], ModelProfile]] = {
    "vgg16": vgg16,
    "resnet50": resnet50,
    "transformer": transformer,
    "bert-large": bert_large,
    "gpt2": gpt2,
}


def names() -> list[str]:
    """Names of the built-in profiles."""
    return list(_BUILTINS)


@functools.cache
def builtin(name: str) -> ModelProfile:
    """The built-in profile `name` (one of :func:`names`); profiles are immutable, so the
    same object is returned each time."""
    try:
        make = _BUILTINS[name]
    except KeyError:
        raise ValueError(
            f"no built-in profile named {name!r} (built-ins: {', '.join(_BUILTINS)})"
        ) from None
    return make()
