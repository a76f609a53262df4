"""Models assembled from cukernels.nn."""
