// Sixteen allocations (size in units, first use, last use) whose most bytes live at once,
// 17 units, is out of reach: the smallest arena is 18 units. Included by the planner's unit
// tests and by tests/plan_challenging.rs.
[
    (4, 0, 0),
    (4, 7, 11),
    (5, 5, 5),
    (4, 0, 4),
    (5, 2, 5),
    (3, 6, 7),
    (3, 8, 8),
    (4, 0, 0),
    (3, 3, 4),
    (2, 0, 1),
    (2, 3, 3),
    (5, 8, 8),
    (5, 6, 7),
    (3, 0, 3),
    (5, 4, 7),
    (4, 1, 2),
]
