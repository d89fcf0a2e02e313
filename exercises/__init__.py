"""The course's exercises: one folder per chapter, a starting file to edit and a check to run
(exercises/README.md; `make exercise ch=NN`)."""
