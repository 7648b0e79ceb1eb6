"""The one error every step of the conversion raises for a file it cannot convert."""


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted (architecture, tensor type, tokenizer, ...)."""
