"""Small built-in jobs that run verl's real trainer on CPU (demos and smoke tests)."""
