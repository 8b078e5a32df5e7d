"""`omrl`: the job API's command line (submit, list, status, follow, cancel, logs)."""
