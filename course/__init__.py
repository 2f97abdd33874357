"""The course's tooling: the exercise checks (course/exercises/), the stage 2 -> 3
lesson series (course/series.py) and the course map's tests column (course/chapter_tests.py).

It stands above the stages, beside bench/ and tests/: an exercise check compares a
student's copy with a stage's own code, so it imports the stages, and nothing in
common/ or in a stage imports it (docs/exercises.md, "Where the checks live").
"""
