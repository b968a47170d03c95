"""Kubernetes deployment: manifests, the image and the workers' liveness probe."""
