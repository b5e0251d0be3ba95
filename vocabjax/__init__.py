"""vocabjax: choose the tokenizer vocabulary size for how the model will be served."""

__version__ = "0.1.0"
