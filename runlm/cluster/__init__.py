"""Serving one model from many runlm replicas: request routing and its simulation."""
