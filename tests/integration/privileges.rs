//! Privilege (issue 7, item 5): the capabilities lens-probe needs, those it drops after
//! attaching, and what it reads from a target (an allow-list; secrets never exported).
