"""The trajectory inspector: a read-only web view of runs (curves, recorded steps, episodes and their tokens),
rendered on the server from run folders or the job API's jobs. docs/inspector.md describes it."""
