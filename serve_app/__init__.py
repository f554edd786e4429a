"""The HTTP edge: OpenAI protocol, text (tokenization, detokenization, stop strings), SSE,
health, and the Ray Serve ingress. The engine below it sees token ids only.

Pure modules (no ray import): protocol, errors, sampling, tokenizer, detokenizer,
stop_strings, choice_tracker, logprobs, sse, generation, completions, chat, api, health.
Ray lives in engine_client_ray.py and app.py only.
"""
