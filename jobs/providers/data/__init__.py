"""Price tables shipped with the providers: dated, each refreshed by its provider."""
