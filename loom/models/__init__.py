from loom.models.llama import Transformer, build_model

__all__ = ["Transformer", "build_model"]
