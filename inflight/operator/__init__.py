"""The kopf operator that turns InferenceDeployment resources into runtime pods."""
