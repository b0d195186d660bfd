"""One-off studies: each answered a question whose conclusion is in docs/ and bench/results/
(the results index names the command that reran it); rerun one to revisit its question. The
benchmark and the checks that guard a stated target are in bench/."""
