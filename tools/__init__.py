"""Programs of their own beside the recipe: the preflight check of a distributed job, the recipe's measurement."""
