"""Fronting AgentGym environment servers (HTTP, one per family) as an env of this service."""
