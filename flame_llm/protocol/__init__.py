"""The protocol between client, router, actors, HTTP and bench: request/result/error types, the wire
codec, prompt-prefix identity for routing."""
