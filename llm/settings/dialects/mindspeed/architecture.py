"""The model files' architecture names, checked against the checkpoint's config.json (the checkpoint
describes the model here), and the Megatron / MindSpeed kernel choices, accepted as names only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from llm.settings.dialects.mindspeed.rule_types import ROLE_PLACES, Given, Translation

ARCHITECTURE: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # Megatron model-file name -> (what config.json calls it, its value there)
    "num_layers": ("num_hidden_layers", lambda c: c.num_hidden_layers),
    "hidden_size": ("hidden_size", lambda c: c.hidden_size),
    "ffn_hidden_size": ("intermediate_size", lambda c: c.intermediate_size),
    "num_attention_heads": ("num_attention_heads", lambda c: c.num_attention_heads),
    "num_query_groups": ("num_key_value_heads", lambda c: c.num_key_value_heads),
    "group_query_attention": (
        "num_key_value_heads < num_attention_heads",
        lambda c: c.num_key_value_heads < c.num_attention_heads,
    ),
    "max_position_embeddings": ("max_position_embeddings", lambda c: c.max_position_embeddings),
    "padded_vocab_size": ("vocab_size", lambda c: c.vocab_size),
    "rotary_base": ("rope_theta", lambda c: _rope(c).get("rope_theta", getattr(c, "rope_theta", None))),
    "norm_epsilon": ("rms_norm_eps", lambda c: getattr(c, "rms_norm_eps", None)),
    "untie_embeddings_and_output_weights": ("not tie_word_embeddings", lambda c: not c.tie_word_embeddings),
    "rope_scaling_type": ("rope_type", lambda c: _rope(c).get("rope_type")),
    "rope_scaling_factor": ("rope factor", lambda c: _rope(c).get("factor")),
    "low_freq_factor": ("low_freq_factor", lambda c: _rope(c).get("low_freq_factor")),
    "high_freq_factor": ("high_freq_factor", lambda c: _rope(c).get("high_freq_factor")),
    "original_max_position_embeddings": (
        "original_max_position_embeddings",
        lambda c: _rope(c).get("original_max_position_embeddings"),
    ),
    "attention_dropout": ("attention_dropout", lambda c: getattr(c, "attention_dropout", 0.0)),
    "hidden_dropout": ("hidden dropout (none in these models)", lambda c: getattr(c, "hidden_dropout", 0.0)),
    "disable_bias_linear": (
        "no attention_bias / mlp_bias",
        lambda c: not (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
    ),
    "swiglu": ("hidden_act silu", lambda c: getattr(c, "hidden_act", None) == "silu"),
    "normalization": ("RMSNorm (rms_norm_eps)", lambda c: "RMSNorm" if hasattr(c, "rms_norm_eps") else "LayerNorm"),
    "position_embedding_type": ("rope", lambda c: "rope" if _rope(c) or hasattr(c, "rope_theta") else "absolute"),
}


def _rope(config: Any) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def architecture_name(t: Translation, role: str, g: Given) -> None:
    """Checked against the `config.json` of the role's `load` directory; a mismatch stops."""
    t.typed(g, bool | int | float | str)  # compared with config.json once load is known (check_architecture)


KERNELS = (
    "use_flash_attn",
    "use_mc2",
    "use_fused_rmsnorm",
    "use_fused_swiglu",
    "use_fused_rotary_pos_emb",
    "use_rotary_position_embeddings",
    "no_masked_softmax_fusion",
    "attention_softmax_in_fp32",
    "no_gradient_accumulation_fusion",
    "make_vocab_size_divisible_by",
    "init_method_std",
)


def check_architecture(t: Translation) -> None:
    """The model file describes the model; here the checkpoint's config.json does: they must agree."""
    from transformers import AutoConfig

    for role, directory in t.models.items():
        config = None
        for name, g in t.merged[role].items():
            if name not in ARCHITECTURE:
                continue
            config = config or AutoConfig.from_pretrained(directory)
            label, read = ARCHITECTURE[name]
            have = read(config)
            want = g.value
            equal = (
                math.isclose(float(want), float(have), rel_tol=1e-9)
                if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(have, (int, float))
                else want == have
            )
            if not equal:
                raise t.fail(
                    g.where,
                    f"{want!r} but {directory}/config.json has {label} = {have!r}: the model file must describe the "
                    f"checkpoint in {ROLE_PLACES[role]}.load",
                )
