"""`nerva serve`: ollama's and OpenAI's HTTP APIs over the runtime.

app.py builds the Starlette app and runs it on uvicorn; ollama_routes.py and openai_routes.py
parse and shape each API; pipeline.py is what both do between a parsed request and its events
(the model, the prompt's tokens, the context's checks); scheduler.py holds the loaded models,
each with a worker thread that owns its engines and steps them; job.py is one request between
its handler and that worker; steps.py is one request's work on one engine, a step at a time.
"""
