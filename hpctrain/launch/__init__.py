"""Login-node side: run directories, submitit executors, submission and the command line."""
