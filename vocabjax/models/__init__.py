"""Models trained and served by vocabjax: a Flax NNX GPT with nested vocabulary heads."""

from vocabjax.models.gpt import GPT, HEADS_KINDS, GPTConfig, HeadsKind, head_loss

__all__ = ["GPT", "HEADS_KINDS", "GPTConfig", "HeadsKind", "head_loss"]
