"""The verifier service: hosts the target model and verifies draft trees exactly."""
