"""The coordinator: the client API and the speculative round loop over the two services."""
