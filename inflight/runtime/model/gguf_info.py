"""The architecture facts of a GGUF file, checked before anything is sized from them.

:func:`check_supported` reads the Llama-family hyperparameters (layers, widths, heads, vocabulary,
context length, rope base, RMS epsilon) from the header and holds them to what a model can be:
integers in range (:mod:`gguf_checks`' bounds), finite positive floats, and agreement with the
tensor table (every layer ``0..block_count-1`` present and no other, every tensor the shape the
hyperparameters give it), so a header cannot make the converter or the engine allocate for
2^32 layers or serve a NaN epsilon. Each refusal is a one-line ``GGUFError`` naming the key.
Works on :class:`~inflight.runtime.model.gguf_index.GGUFIndex` and on anything with
``GGUFReader``'s ``fields``. Knows nothing about converting or serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.model.gguf_checks import (
    MAX_CONTEXT,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    GGUFError,
    field_name,
    finite_in,
    int_in,
    shown,
)

# GGUF architecture -> the transformers architecture it converts to.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_MAX_ROPE_BASE = 1e12


@dataclass(frozen=True, slots=True)
class GGUFModelInfo:
    """The architecture facts read from a GGUF header."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool


def supported_quantization_types() -> tuple[str, ...]:
    """Names of the GGML tensor types this converter can dequantize (the ``gguf`` package's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the registry of types gguf.quants implements

    names = {"F32", "F16"} | {t.name for t in _type_traits}
    return tuple(sorted(names & {t.name for t in GGMLQuantizationType}))


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (scalars, strings and, read on demand, arrays), or ``default`` when the
    key is absent."""
    values = getattr(reader, "values", None)
    if isinstance(values, dict):  # a GGUFIndex
        if key in values:
            return values[key]
        array = reader.array(key)
        return default if array is None else array
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def source_path(reader: Any) -> Path:
    """The file a reader read, for messages (a stand-in without one: ``GGUF file``)."""
    return Path(getattr(reader, "path", "GGUF file"))


def _architecture(reader: Any) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {_shown(arch)}; inflight converts "
            f"{', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))} (Llama, Mistral, SmolLM and other "
            "Llama-architecture models)."
        )
    return str(arch)


def _shown(value: Any) -> str:
    return shown(value) if isinstance(value, str) else f"of type {type(value).__name__}"


def read_model_info(reader: Any) -> GGUFModelInfo:
    """Architecture facts from the header, each checked; ``ValueError`` for an unsupported
    architecture, ``GGUFError`` for a missing, mistyped or out-of-range value."""
    arch, path = _architecture(reader), source_path(reader)

    def number(key: str, low: int, high: int, default: Any = None) -> int:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(path, f"{arch}.{key}", "missing; the file cannot be converted")
        return int_in(path, f"{arch}.{key}", value, low, high)

    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(path, "tensor token_embd.weight", "missing; a Llama-architecture model needs it")
    num_heads = number("attention.head_count", 1, MAX_HEADS)
    hidden = number("embedding_length", 1, MAX_WIDTH)
    head_dim = number("rope.dimension_count", 2, MAX_WIDTH, hidden // num_heads)
    if head_dim % 2:
        raise GGUFError(path, f"{arch}.rope.dimension_count", f"{head_dim} is odd; rope rotates pairs")
    eps = field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    if eps is None:
        raise GGUFError(path, f"{arch}.attention.layer_norm_rms_epsilon", "missing; the file cannot be converted")
    return GGUFModelInfo(
        architecture=arch,
        num_layers=number("block_count", 1, MAX_LAYERS),
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length", 1, MAX_WIDTH),
        num_heads=num_heads,
        num_kv_heads=number("attention.head_count_kv", 1, num_heads, num_heads),
        head_dim=head_dim,
        vocab_size=number("vocab_size", 1, MAX_VOCAB, int(embed.shape[-1])),
        max_position_embeddings=number("context_length", 1, MAX_CONTEXT),
        rope_theta=finite_in(path, f"{arch}.rope.freq_base",
                             field_value(reader, f"{arch}.rope.freq_base", 10000.0), 0.0, _MAX_ROPE_BASE),
        rms_norm_eps=finite_in(path, f"{arch}.attention.layer_norm_rms_epsilon", eps, 0.0, 1.0),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
    )


def check_supported(reader: Any) -> GGUFModelInfo:
    """Validate architecture, tensor types, rope scaling, hyperparameters and the tensor table
    against them, before any work is done."""
    arch = _architecture(reader)
    supported = set(supported_quantization_types())
    bad = sorted({t.tensor_type.name for t in reader.tensors} - supported)
    if bad:
        raise ValueError(
            f"unsupported GGUF tensor type(s) {', '.join(bad)}; supported: {', '.join(sorted(supported))}."
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            "unsupported GGUF rope scaling: the file carries Llama 3.1-style rope frequency factors "
            "(rope_freqs.weight); only unscaled rope converts. Use the model's Hugging Face directory."
        )
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {_shown(scaling)}; only unscaled rope converts.")
    info = read_model_info(reader)
    check_tensor_table(reader, info)
    return info


def check_tensor_table(reader: Any, info: GGUFModelInfo) -> None:
    """Every layer ``0..block_count-1`` has tensors and no other does; every known tensor has the
    dims (GGUF order: the row length first) the hyperparameters give it."""
    path, layers = source_path(reader), set()
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            index = parts[1] if len(parts) == 4 else ""
            if not (index.isascii() and index.isdecimal() and int(index) < info.num_layers):
                raise GGUFError(path, f"tensor {field_name(tensor.name)}", f"not a tensor of one of the "
                                f"{info.num_layers} layers {info.architecture}.block_count declares")
            layers.add(int(index))
        want = expected_dims(parts, info)
        dims = [int(d) for d in tensor.shape]
        if want is not None and dims != want:
            raise GGUFError(path, f"tensor {field_name(tensor.name)}",
                            f"dims {dims} disagree with the header's hyperparameters (expected {want})")
    if len(layers) != info.num_layers:
        raise GGUFError(path, f"{info.architecture}.block_count", f"declares {info.num_layers} layers "
                        f"but the file has tensors for {len(layers)}")


def expected_dims(parts: list[str], info: GGUFModelInfo) -> list[int] | None:
    """The GGUF dims of a Llama tensor (name split at dots), ``None`` for a name not known here."""
    h, f, v = info.hidden_size, info.intermediate_size, info.vocab_size
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    weights = {
        "token_embd": [h, v], "output": [h, v], "output_norm": [h],
        "attn_q": [h, q], "attn_k": [h, kv], "attn_v": [h, kv], "attn_output": [q, h],
        "ffn_gate": [h, f], "ffn_up": [h, f], "ffn_down": [f, h], "attn_norm": [h], "ffn_norm": [h],
    }  # fmt: skip
    base, suffix = (parts[2], parts[3]) if parts[0] == "blk" else (parts[0], parts[-1])
    want = weights.get(base)
    if want is None or len(parts) != (4 if parts[0] == "blk" else 2):
        return None
    if suffix == "weight":
        return want
    return want[-1:] if suffix == "bias" else None
