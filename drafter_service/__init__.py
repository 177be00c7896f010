"""The drafter service: hosts the small model and proposes draft trees."""
