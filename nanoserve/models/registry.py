"""Which family a checkpoint is, by name: config.json's `model_type` or a GGUF's
`general.architecture` (the two use the same names for the families here).

A family file registers a `Family` when it is imported (`nanoserve.models` imports them all):
its name, the class transformers gives it (what a converted directory's config.json says), the
module that runs it, how its config.json sets the forward's switches, and whether llama.cpp's
converter reordered its Q/K rows in a GGUF. A second family is a new file and one `register`
call; nothing else in the package branches on a family's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.errors import NanoserveError


@dataclass(frozen=True)
class Family:
    name: str  # config.json's model_type, a GGUF's general.architecture
    hf_architecture: str  # e.g. "Qwen2ForCausalLM": what a converted directory's config.json names
    model: type  # the nn.Module that runs it, built as model(cfg, dtype=, device=)
    switches: Callable[[dict], dict]  # config.json -> the LlamaConfig fields this family sets
    # llama.cpp's converter interleaves each head's Q/K rows for the families its graph rotates in
    # pairs (llama); the ones it rotates in halves (NEOX: qwen2, qwen3) keep Hugging Face's rows
    gguf_rotary_permuted: bool = False
    # whether its switches read config.json's sliding_window (layers attending to their latest
    # positions only); a family that does not is refused a checkpoint whose window is narrower
    # than its context, rather than run as if it attended to all
    sliding_windows: bool = False
    # config.json's model_type when transformers' differs from the GGUF's name ("gemma3_text")
    model_type: str | None = None
    # a GGUF's block tensor names this family reads otherwise than a Llama ("ffn_norm" is the
    # norm before the MLP everywhere; Gemma 3 also has norms after attention and after the MLP)
    gguf_names: dict = field(default_factory=dict)
    # subtracted from a GGUF's norm weights on conversion to a Hugging Face directory (Gemma's
    # checkpoints store w for a gain of 1 + w; llama.cpp's converter stored the gain)
    gguf_norm_shift: float = 0.0
    # the GGUF's metadata (a getter of "<arch>.<key>") -> config.json entries beyond a Llama's
    gguf_config: Callable | None = None


FAMILIES: dict[str, Family] = {}


def register(f: Family) -> Family:
    if f.name in FAMILIES or f.model_type in FAMILIES:
        raise ValueError(f"a family named {f.name!r} is registered already")
    FAMILIES[f.name] = f
    return f


def family(name: str, what: str = "config.json's model_type") -> Family:
    """The family `name` names, or a NanoserveError listing the ones nanoserve runs."""
    import nanoserve.models  # noqa: F401 -- registers every family file

    if name not in FAMILIES:
        for f in FAMILIES.values():
            if f.model_type == name:
                return f
        raise NanoserveError(
            f"{what} is {name!r}, a family nanoserve does not run; it runs {', '.join(map(repr, FAMILIES))}."
        )
    return FAMILIES[name]
