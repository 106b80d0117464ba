//! The output budget every pull call shares (docs/API.md "Limits", docs/DESIGN.md §Memory).

use crate::limits;

/// What one call collects before it returns its first row, in total over everything it reads
/// (docs/API.md "Limits", docs/DESIGN.md §Memory): the bytes of the rows' payloads, scopes,
/// column versions and ids. Another commit or row starts only while the total is below
/// [`limits::OUTPUT_BYTES`]; the first one always goes (a commit is never split), so a call
/// exceeds the budget by at most one commit or row and always makes progress.
pub struct Budget {
    used: usize,
}

impl Budget {
    pub fn new() -> Budget {
        Budget { used: 0 }
    }

    /// Whether another commit or row may start.
    pub fn open(&self) -> bool {
        self.used < limits::OUTPUT_BYTES
    }

    pub fn spend(&mut self, bytes: usize) {
        self.used = self.used.saturating_add(bytes);
    }
}

/// What a row costs in the budget besides its values: the columns' fixed part, roughly.
pub const ROW_OVERHEAD: usize = 64;
