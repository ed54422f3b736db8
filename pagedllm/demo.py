"""The demo model bundled inside the package, so pagedllm runs with no model hub.

It is a small Llama trained on the Python standard library's source by ``tools/train_demo_model.py``
(see ``demo_model/README.md``): a code-completion model, not an assistant.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"

# What a complete demo model directory holds (weights, model config and tokenizer).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model() -> str:
    """Path of the bundled demo model, for ``LLM(model=default_model())``.

    Raises ``ValueError`` saying how to build it when its weights or tokenizer are missing (a source
    checkout before the model was trained, or a package built without it).
    """
    missing = [name for name in _REQUIRED_FILES if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise ValueError(
            f"the bundled demo model is missing from {DEMO_MODEL_DIR} (no {', '.join(missing)}); build it "
            f"from a source checkout with `python tools/train_demo_model.py` (a few minutes on one GPU; "
            f"`--config tiny` gives an untrained-quality model in seconds on CPU), or pass a model path"
        )
    return str(DEMO_MODEL_DIR)


def demo_draft_model() -> str:
    """The small demo model (same tokenizer) that drafts for the default one:
    ``speculative_config={"model": demo_draft_model(), "num_speculative_tokens": 4}``."""
    return str(DEMO_MODEL_DIR / "draft")


def demo_eagle_head() -> str:
    """The EAGLE-1 head trained for the default demo model:
    ``speculative_config={"method": "eagle", "model": demo_eagle_head(), "num_speculative_tokens": 3}``."""
    return str(DEMO_MODEL_DIR / "eagle")


def demo_medusa_head() -> str:
    """The Medusa heads (3, chain drafts) trained for the default demo model:
    ``speculative_config={"method": "medusa", "model": demo_medusa_head(), "num_speculative_tokens": 3}``."""
    return str(DEMO_MODEL_DIR / "medusa")
