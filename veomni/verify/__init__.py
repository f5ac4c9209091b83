"""`python -m veomni.verify CONFIG`: a user's config, run once as one process and once per parallel layout that fits
the local ranks, compared step by step (loss, grad norm, every parameter's gradient at equal weights), its resume
checked bit-exact; one table, a non-zero exit on any failure. See README "Verify your layout"."""
