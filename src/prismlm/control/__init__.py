"""Control: prototype suppression, sparse controllers, multiple-choice tasks, judges, SAE baseline."""
