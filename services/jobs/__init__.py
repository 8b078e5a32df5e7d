"""The job API: submit, list, follow and cancel training jobs over REST (`python -m services.jobs`)."""
