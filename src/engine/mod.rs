//! See DESIGN.md, layer `engine`.
