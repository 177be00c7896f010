"""Pure math and model-side pieces both services share: draft trees, verification and
sampling, KV-cache compaction, model loading, steering, the model engine. No gRPC, no Ray."""
