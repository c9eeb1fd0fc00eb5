"""Serving: the Python client and its batchers, the service (router + engine actors on Ray), its
config, and the standalone engine over HTTP."""
