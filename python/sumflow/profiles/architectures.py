"""The built-in models' layers, derived from their architectures: parameter tensors (names,
shapes and order as the reference implementation's ``named_parameters()`` gives them) and
forward FLOPs per sample.

FLOPs count a multiply-add as 2 and cover the convolutions, the linear layers and the
attention matrix products (``QK^T`` and ``AV``); element-wise work (batch and layer norm,
activations, pooling, softmax, residual adds, biases) is not counted. The figures usually
quoted as "GFLOPs" for CNNs (VGG-16 15.5, ResNet-50 4.1) count multiply-adds, so they are
half of :attr:`ArchLayer.flops` summed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sumflow.profiles.format import ParamSpec


@dataclass(frozen=True)
class ArchLayer:
    """One layer of an architecture: its parameters and its forward FLOPs for one sample."""

    name: str
    params: tuple[ParamSpec, ...]
    flops: int


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _conv_flops(cin: int, cout: int, kernel: int, out_size: int) -> int:
    return 2 * cin * cout * kernel * kernel * out_size * out_size


def _linear_flops(fan_in: int, fan_out: int, rows: int = 1) -> int:
    return 2 * fan_in * fan_out * rows


#: torchvision's configuration "D" of VGG: output channels, "M" = 2x2 max pooling.
_VGG16_CONFIG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def vgg16(image_size: int = 224, classes: int = 1000) -> list[ArchLayer]:
    """torchvision's ``vgg16()`` (no batch norm): 13 3x3 convolutions with bias, then three
    linear layers (25088 -> 4096 -> 4096 -> classes). One layer per convolution or linear
    layer, named by its module (``features.0`` ... ``classifier.6``); pooling, ReLU and
    dropout have no parameters and are folded into the layer before them. 32 tensors,
    138,357,544 parameters; 15.47 G multiply-adds per 224x224 image."""
    layers: list[ArchLayer] = []
    cin, size, index = 3, image_size, 0
    for v in _VGG16_CONFIG:
        if v == "M":
            size //= 2
            index += 1
            continue
        assert isinstance(v, int)
        name = f"features.{index}"
        layers.append(
            ArchLayer(
                name,
                (ParamSpec(f"{name}.weight", (v, cin, 3, 3)), ParamSpec(f"{name}.bias", (v,))),
                _conv_flops(cin, v, 3, size),
            )
        )
        cin = v
        index += 2  # the convolution and its ReLU
    # AdaptiveAvgPool2d((7, 7)) makes the classifier's input 512x7x7 at any image size.
    for index, (fan_in, fan_out) in zip(
        (0, 3, 6), ((512 * 7 * 7, 4096), (4096, 4096), (4096, classes)), strict=True
    ):
        name = f"classifier.{index}"
        layers.append(
            ArchLayer(
                name,
                (
                    ParamSpec(f"{name}.weight", (fan_out, fan_in)),
                    ParamSpec(f"{name}.bias", (fan_out,)),
                ),
                _linear_flops(fan_in, fan_out),
            )
        )
    return layers


def resnet50(image_size: int = 224, classes: int = 1000) -> list[ArchLayer]:
    """torchvision's ``resnet50()`` (v1.5: the stride of a stage's first block is on its
    3x3 convolution): a 7x7 stem, 3+4+6+3 bottleneck blocks of widths 64 to 512
    (expansion 4, a 1x1 projection shortcut in each stage's first block), a classifier.

    One layer per convolution together with its batch norm (named by the convolution's
    module: ``conv1``, ``layer1.0.conv1``, ``layer1.0.downsample``) and one for ``fc``:
    54 layers, 161 tensors, 25,557,032 parameters, 4.09 G multiply-adds per 224x224
    image. The order is ``named_parameters()``'s, which is also the order of execution
    (torchvision computes a block's shortcut after its main branch)."""
    layers: list[ArchLayer] = []

    def conv_bn(conv: str, bn: str, cin: int, cout: int, k: int, out_size: int) -> None:
        name = conv.removesuffix(".0")  # the shortcut's conv is downsample.0, its BN .1
        layers.append(
            ArchLayer(
                name,
                (
                    ParamSpec(f"{conv}.weight", (cout, cin, k, k)),
                    ParamSpec(f"{bn}.weight", (cout,)),
                    ParamSpec(f"{bn}.bias", (cout,)),
                ),
                _conv_flops(cin, cout, k, out_size),
            )
        )

    size = _conv_out(image_size, 7, 2, 3)
    conv_bn("conv1", "bn1", 3, 64, 7, size)
    size = _conv_out(size, 3, 2, 1)  # max pooling
    cin = 64
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            stride = 2 if b == 0 and stage > 1 else 1
            out = _conv_out(size, 3, stride, 1)
            conv_bn(f"{p}.conv1", f"{p}.bn1", cin, width, 1, size)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3, out)
            conv_bn(f"{p}.conv3", f"{p}.bn3", width, width * 4, 1, out)
            if b == 0:
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", cin, width * 4, 1, out)
            cin, size = width * 4, out
    layers.append(
        ArchLayer(
            "fc",
            (ParamSpec("fc.weight", (classes, cin)), ParamSpec("fc.bias", (classes,))),
            _linear_flops(cin, classes),
        )
    )
    return layers


def transformer_base(
    *,
    vocab: int = 37000,
    d_model: int = 512,
    ffn: int = 2048,
    layers: int = 6,
    src_len: int = 128,
    tgt_len: int = 128,
) -> list[ArchLayer]:
    """The base Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as fairseq
    implements it (``transformer_wmt_en_de`` with ``share_all_embeddings``): post-norm
    layers, linear projections with biases, layer norms with scale and shift, sinusoidal
    positions (no parameters), one token embedding shared by encoder input, decoder input
    and the output projection (no final layer norms, no output bias).

    One sample is a sentence pair of `src_len` source and `tgt_len` target tokens. Layers:
    ``embed`` (the shared embedding, no FLOPs counted for its look-ups), then per encoder
    layer ``self_attn`` and ``ffn``, per decoder layer ``self_attn``, ``encoder_attn`` and
    ``ffn`` (each with its layer norm), then ``decoder.output_projection``, which owns no
    tensor (its weight is the embedding) but does the vocabulary-sized matrix product.
    Attention FLOPs include the sequence-squared products (``QK^T``, ``AV``) over the full
    matrices (the decoder's causal mask saves nothing in a dense kernel). The number of
    heads changes neither parameters nor FLOPs. Defaults: 37,000 tokens (the paper's
    shared English-German BPE vocabulary), 6+6 layers of width 512 and 2048: 253 tensors,
    63,082,496 parameters (18,944,000 of them the embedding), 16.73 GFLOPs per pair."""
    d = d_model
    out: list[ArchLayer] = [
        ArchLayer("embed", (ParamSpec("encoder.embed_tokens.weight", (vocab, d)),), 0)
    ]

    def linear(prefix: str, fan_in: int, fan_out: int) -> tuple[ParamSpec, ...]:
        return (
            ParamSpec(f"{prefix}.weight", (fan_out, fan_in)),
            ParamSpec(f"{prefix}.bias", (fan_out,)),
        )

    def attention(prefix: str, attn: str, q_len: int, kv_len: int) -> ArchLayer:
        params = (
            *linear(f"{prefix}.{attn}.k_proj", d, d),
            *linear(f"{prefix}.{attn}.v_proj", d, d),
            *linear(f"{prefix}.{attn}.q_proj", d, d),
            *linear(f"{prefix}.{attn}.out_proj", d, d),
            ParamSpec(f"{prefix}.{attn}_layer_norm.weight", (d,)),
            ParamSpec(f"{prefix}.{attn}_layer_norm.bias", (d,)),
        )
        flops = (
            _linear_flops(d, d, q_len) * 2  # queries and the output projection
            + _linear_flops(d, d, kv_len) * 2  # keys and values
            + 2 * q_len * kv_len * d * 2  # QK^T and AV, all heads together
        )
        return ArchLayer(f"{prefix}.{attn}", params, flops)

    def feed_forward(prefix: str, tokens: int) -> ArchLayer:
        params = (
            *linear(f"{prefix}.fc1", d, ffn),
            *linear(f"{prefix}.fc2", ffn, d),
            ParamSpec(f"{prefix}.final_layer_norm.weight", (d,)),
            ParamSpec(f"{prefix}.final_layer_norm.bias", (d,)),
        )
        flops = _linear_flops(d, ffn, tokens) + _linear_flops(ffn, d, tokens)
        return ArchLayer(f"{prefix}.ffn", params, flops)

    for i in range(layers):
        p = f"encoder.layers.{i}"
        out += [attention(p, "self_attn", src_len, src_len), feed_forward(p, src_len)]
    for i in range(layers):
        p = f"decoder.layers.{i}"
        out += [
            attention(p, "self_attn", tgt_len, tgt_len),
            attention(p, "encoder_attn", tgt_len, src_len),
            feed_forward(p, tgt_len),
        ]
    out.append(ArchLayer("decoder.output_projection", (), _linear_flops(d, vocab, tgt_len)))
    return out


def _linear(prefix: str, fan_in: int, fan_out: int) -> tuple[ParamSpec, ...]:
    """A linear layer's weight (out x in, as torch.nn.Linear stores it) and bias."""
    return (
        ParamSpec(f"{prefix}.weight", (fan_out, fan_in)),
        ParamSpec(f"{prefix}.bias", (fan_out,)),
    )


def _norm(prefix: str, d: int) -> tuple[ParamSpec, ...]:
    return (ParamSpec(f"{prefix}.weight", (d,)), ParamSpec(f"{prefix}.bias", (d,)))


def _attention_flops(d: int, tokens: int) -> int:
    """q, k, v and output projections plus ``QK^T`` and ``AV`` over the full matrices (a
    dense kernel saves nothing from a causal mask), self-attention over `tokens`."""
    return 4 * _linear_flops(d, d, tokens) + 2 * 2 * tokens * tokens * d


def bert_large(*, vocab: int = 30522, seq_len: int = 128) -> list[ArchLayer]:
    """BERT-large (Devlin et al., 2019) as Hugging Face's ``BertForPreTraining`` defines
    it: hidden size 1024, 16 heads, feed-forward 4096, 24 post-norm encoder layers, 512
    learned positions, 2 segment types, a pooler, and the pre-training heads (masked LM:
    a dense transform with layer norm and a decoder tied to the word embeddings, so it owns
    only its bias; next-sentence prediction). Names follow Hugging Face's.

    One sample is a sequence of `seq_len` tokens (128: phase 1 of pre-training); the
    masked-LM decoder projects every token onto the vocabulary. Layers: the embeddings
    (no FLOPs counted for look-ups), per encoder layer ``attention`` and ``ffn`` (each with
    its layer norm), ``pooler`` (first token only), ``cls.predictions.transform``,
    ``cls.predictions.decoder`` (bias only) and ``cls.seq_relationship``. 398 tensors,
    336,226,108 parameters (335,141,888 without the heads, the figure usually quoted)."""
    d, ffn, layers = 1024, 4096, 24
    out = [
        ArchLayer(
            "bert.embeddings",
            (
                ParamSpec("bert.embeddings.word_embeddings.weight", (vocab, d)),
                ParamSpec("bert.embeddings.position_embeddings.weight", (512, d)),
                ParamSpec("bert.embeddings.token_type_embeddings.weight", (2, d)),
                *_norm("bert.embeddings.LayerNorm", d),
            ),
            0,
        )
    ]
    for i in range(layers):
        p = f"bert.encoder.layer.{i}"
        out.append(
            ArchLayer(
                f"{p}.attention",
                (
                    *_linear(f"{p}.attention.self.query", d, d),
                    *_linear(f"{p}.attention.self.key", d, d),
                    *_linear(f"{p}.attention.self.value", d, d),
                    *_linear(f"{p}.attention.output.dense", d, d),
                    *_norm(f"{p}.attention.output.LayerNorm", d),
                ),
                _attention_flops(d, seq_len),
            )
        )
        out.append(
            ArchLayer(
                f"{p}.ffn",
                (
                    *_linear(f"{p}.intermediate.dense", d, ffn),
                    *_linear(f"{p}.output.dense", ffn, d),
                    *_norm(f"{p}.output.LayerNorm", d),
                ),
                _linear_flops(d, ffn, seq_len) + _linear_flops(ffn, d, seq_len),
            )
        )
    out += [
        ArchLayer("bert.pooler", _linear("bert.pooler.dense", d, d), _linear_flops(d, d)),
        ArchLayer(
            "cls.predictions.transform",
            (
                *_linear("cls.predictions.transform.dense", d, d),
                *_norm("cls.predictions.transform.LayerNorm", d),
            ),
            _linear_flops(d, d, seq_len),
        ),
        ArchLayer(
            "cls.predictions.decoder",
            (ParamSpec("cls.predictions.bias", (vocab,)),),
            _linear_flops(d, vocab, seq_len),
        ),
        ArchLayer(
            "cls.seq_relationship", _linear("cls.seq_relationship", d, 2), _linear_flops(d, 2)
        ),
    ]
    return out


def gpt2(*, vocab: int = 50257, positions: int = 1024, seq_len: int = 1024) -> list[ArchLayer]:
    """GPT-2 (Radford et al., 2019), the 124M model, as Hugging Face's ``GPT2LMHeadModel``
    defines it: width 768, 12 heads, feed-forward 3072, 12 pre-norm blocks, 1024 learned
    positions, a final layer norm, and a language-model head tied to the token embedding
    (no tensor of its own). Hugging Face stores the projections as ``Conv1D`` (in x out);
    names and shapes follow it.

    One sample is a sequence of `seq_len` tokens (the full context, 1024). Layers:
    ``transformer.embed`` (token and position embeddings, no FLOPs counted), per block
    ``attn`` (with ``ln_1``) and ``mlp`` (with ``ln_2``), ``transformer.ln_f``, and
    ``lm_head``, whose FLOPs are the vocabulary projection of every token. 148 tensors,
    124,439,808 parameters."""
    d, ffn, blocks = 768, 3072, 12

    def conv1d(prefix: str, fan_in: int, fan_out: int) -> tuple[ParamSpec, ...]:
        return (
            ParamSpec(f"{prefix}.weight", (fan_in, fan_out)),
            ParamSpec(f"{prefix}.bias", (fan_out,)),
        )

    out = [
        ArchLayer(
            "transformer.embed",
            (
                ParamSpec("transformer.wte.weight", (vocab, d)),
                ParamSpec("transformer.wpe.weight", (positions, d)),
            ),
            0,
        )
    ]
    for i in range(blocks):
        p = f"transformer.h.{i}"
        out.append(
            ArchLayer(
                f"{p}.attn",
                (
                    *_norm(f"{p}.ln_1", d),
                    *conv1d(f"{p}.attn.c_attn", d, 3 * d),
                    *conv1d(f"{p}.attn.c_proj", d, d),
                ),
                _attention_flops(d, seq_len),
            )
        )
        out.append(
            ArchLayer(
                f"{p}.mlp",
                (
                    *_norm(f"{p}.ln_2", d),
                    *conv1d(f"{p}.mlp.c_fc", d, ffn),
                    *conv1d(f"{p}.mlp.c_proj", ffn, d),
                ),
                _linear_flops(d, ffn, seq_len) + _linear_flops(ffn, d, seq_len),
            )
        )
    out += [
        ArchLayer("transformer.ln_f", _norm("transformer.ln_f", d), 0),
        ArchLayer("lm_head", (), _linear_flops(d, vocab, seq_len)),
    ]
    return out
