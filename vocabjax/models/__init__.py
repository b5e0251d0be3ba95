"""Models trained and served by vocabjax: a Flax NNX GPT with nested vocabulary heads."""

from vocabjax.models.gpt import GPT, GPTConfig, head_loss

__all__ = ["GPT", "GPTConfig", "head_loss"]
