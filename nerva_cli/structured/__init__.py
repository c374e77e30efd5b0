"""Structured output: answers held to a JSON Schema, JSON or a grammar (ARCHITECTURE 14).

  formats     what a user asks for (--format, --grammar, ollama's `format`, OpenAI's
              `response_format`) turned into one grammar, refused whole when it is wrong
  constraint  one answer's grammar state: the tokens it allows next, applied to the logits
              before the sampler, and the tokens it took

llguidance does the grammar work (the measurement behind the choice: docs/perf/grammar_engines.md).
"""
