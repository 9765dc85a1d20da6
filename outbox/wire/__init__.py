"""One HTTP exchange: build the request, send it, read the answer, classify, redact, look up."""
