"""Stage 1, capture: copies of the user's model to simulate on, and the traced graph of its forward."""
