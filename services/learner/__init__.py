"""The learner: trajectories in, policy updates and weight pushes out."""
