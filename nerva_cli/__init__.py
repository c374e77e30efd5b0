"""nerva: an LLM inference runtime that decides where every block of weights lives."""

__version__ = "0.1.0"
