//! Out of memory is an ERROR, never an abort (docs/DESIGN.md §Memory, docs/SECURITY.md rule 9).
//!
//! A Rust allocation that fails calls `handle_alloc_error`, which on stable Rust aborts the
//! process: PostgreSQL's postmaster then sees a backend die of SIGABRT, ends every session and
//! runs crash recovery. PostgreSQL's own `palloc` raises `53200` instead. Of the two ways to get
//! there — every Rust allocation in `palloc`'d memory, or a global allocator that fails softly —
//! neither works alone:
//!
//! - An allocator cannot raise a PostgreSQL ERROR: a `GlobalAlloc` must not unwind, and the
//!   ERROR's `longjmp` may not cross Rust frames except through pgrx's guards. Returning null
//!   aborts (`handle_alloc_error`). So whatever the allocator does, a failing *infallible*
//!   allocation of a large buffer cannot become an ERROR at the place it fails.
//! - `palloc` for every buffer would tie Rust values to memory contexts they may outlive, and
//!   `palloc` called from inside an allocator is the same forbidden `longjmp`.
//!
//! So both, each where it works:
//!
//! 1. **Fallible allocation for every buffer whose size comes from input or stored data**
//!    ([`try_copy`], [`try_reserve`], [`try_with_capacity`], [`try_base64`]): `try_reserve`
//!    reports the failure without aborting; the caller returns an error, and the call ends in
//!    `53200` ([`crate::error::Error::OutOfMemory`]). Together with the argument caps and the
//!    output budget of a call (docs/API.md "Limits") this leaves only small, bounded
//!    allocations infallible.
//! 2. **A global allocator that fails softly** ([`SoftFail`], over the system allocator) for
//!    those small ones, which run out only when something else (a large `palloc`, another
//!    buffer) took the memory: it keeps an emergency reserve of [`RESERVE_BYTES`]; on the first
//!    failure it frees the reserve and retries, so the allocation succeeds, and records the
//!    failure. The next check point — [`check`] in the loops over input and stored data, and
//!    [`crate::error::run`] at the end of every function — turns it into `ERROR 53200`, after
//!    which the call's Rust values are dropped and the reserve is taken again.
//! 3. If an infallible allocation fails with the reserve already spent, the allocator ends the
//!    session with `FATAL 53200` (`proc_exit(1)`: no `longjmp`, no unwinding; the postmaster
//!    treats exit code 1 as a normal end of one session, not a crash). It is the last line, for
//!    a path the first two missed: one session ends, the cluster does not restart.
//!
//! Nothing here runs before PostgreSQL is ready: until [`init`] (from `_PG_init`, in a backend)
//! the allocator is the system allocator and a failure aborts as Rust's default does (there is
//! no session to end then); the FATAL path also requires `IsUnderPostmaster` (never in the
//! postmaster itself). The cost on the hot paths is one predictable branch per allocation and a
//! handful of relaxed atomic operations per function call.
//!
//! Which call a failure belongs to: every [`crate::error::run`] takes a new generation number
//! for the time it runs (nested calls through SPI take their own and give the outer one back). A
//! failure records the generation that was running; only that call reports it. A failure outside
//! every call (pgrx converting result rows after the body returned) was served from the reserve
//! and is not reported to a later, unrelated call.

use std::alloc::{GlobalAlloc, Layout, System};
#[cfg(not(test))]
use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The emergency reserve: enough for the error path of any call (the texts of an error, the
/// drops and small vectors of the unwinding) once memory ran out. It costs one megabyte of
/// address space per backend, untouched and therefore not resident.
pub const RESERVE_BYTES: usize = 1 << 20;

const RESERVE: Layout = match Layout::from_size_align(RESERVE_BYTES, 16) {
    Ok(layout) => layout,
    Err(_) => panic!("the reserve's layout is valid"),
};

/// The reserve's block while it is held (null once spent or before [`init`]).
static RESERVE_BLOCK: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
/// Set by [`init`]: the library runs inside PostgreSQL, its error machinery is available.
static READY: AtomicBool = AtomicBool::new(false);
/// Set while a fallible allocation runs: its failure is reported to its caller, not handled.
static FALLIBLE: AtomicBool = AtomicBool::new(false);
/// Set once the allocator began ending the session (a failure while exiting aborts; the
/// process is going away).
#[cfg(not(test))]
static EXITING: AtomicBool = AtomicBool::new(false);
/// The generation of the running call (0: none) and the next one to hand out.
static CURRENT: AtomicU64 = AtomicU64::new(0);
static NEXT: AtomicU64 = AtomicU64::new(1);
/// The generation of the first failure not yet reported (0: none) and its request size.
static FAILED_IN: AtomicU64 = AtomicU64::new(0);
static FAILED_SIZE: AtomicUsize = AtomicUsize::new(0);

/// The global allocator of the library: the system allocator, failing softly (module comment).
pub struct SoftFail;

// SAFETY: every method forwards to `System` with the caller's arguments, whose contract is the
// same as ours; the failure path only adds a retry of the same request after freeing a block
// this allocator owns, or ends the process.
unsafe impl GlobalAlloc for SoftFail {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's guarantees (non-zero size).
        let ptr = unsafe { System.alloc(layout) };
        if ptr.is_null() {
            // SAFETY: as above, for the retry.
            return failed(layout.size(), || unsafe { System.alloc(layout) });
        }
        ptr
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's guarantees (non-zero size).
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if ptr.is_null() {
            // SAFETY: as above, for the retry.
            return failed(layout.size(), || unsafe { System.alloc_zeroed(layout) });
        }
        ptr
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator, i.e. by `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded under the caller's guarantees; on failure `ptr` stays valid, so the
        // retry may pass it again.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if moved.is_null() {
            // SAFETY: as above, for the retry.
            return failed(new_size, || unsafe {
                System.realloc(ptr, layout, new_size)
            });
        }
        moved
    }
}

/// The failure path: record, then (infallible requests only) free the reserve and retry, and
/// as the last resort end the session (module comment, 2 and 3).
#[cold]
#[inline(never)]
fn failed(size: usize, retry: impl FnOnce() -> *mut u8) -> *mut u8 {
    record(size);
    if FALLIBLE.load(Relaxed) {
        return std::ptr::null_mut();
    }
    let block = RESERVE_BLOCK.swap(std::ptr::null_mut(), Relaxed);
    if !block.is_null() {
        // SAFETY: the block was allocated by `System` with `RESERVE` and is owned by nobody else
        // (the swap took it).
        unsafe { System.dealloc(block, RESERVE) };
        let ptr = retry();
        if !ptr.is_null() {
            return ptr;
        }
    }
    end_session(size)
}

fn record(size: usize) {
    let current = CURRENT.load(Relaxed);
    if FAILED_IN.load(Relaxed) != current {
        FAILED_IN.store(current, Relaxed);
        FAILED_SIZE.store(size, Relaxed);
    }
}

#[cfg(not(test))]
unsafe extern "C-unwind" {
    fn errstart(elevel: c_int, domain: *const c_char) -> bool;
    fn errcode(sqlerrcode: c_int) -> c_int;
    fn errmsg(fmt: *const c_char, ...) -> c_int;
    fn errdetail(fmt: *const c_char, ...) -> c_int;
    fn errfinish(filename: *const c_char, lineno: c_int, funcname: *const c_char);
}

/// `FATAL 53200` (module comment, 3). Returns null — and so aborts — only where there is no
/// session to end: before [`init`], outside a backend, or when failing again while exiting.
#[cfg(not(test))]
fn end_session(size: usize) -> *mut u8 {
    // SAFETY: reads a backend global that PostgreSQL sets before any library is loaded.
    let backend = READY.load(Relaxed) && unsafe { pgrx::pg_sys::IsUnderPostmaster };
    if !backend || EXITING.swap(true, Relaxed) {
        return std::ptr::null_mut();
    }
    // SAFETY: the elog.c protocol with static C strings and one `size_t` for `%zu`. FATAL does
    // not `longjmp`: `errfinish` reports the error and calls `proc_exit(1)`, which never
    // returns, so no Rust frame is skipped by a jump and nothing here unwinds. Everything this
    // allocates is PostgreSQL's (the error context's own reserved memory).
    unsafe {
        if errstart(pgrx::pg_sys::FATAL as c_int, std::ptr::null()) {
            errcode(crate::port::make_sqlstate("53200"));
            errmsg(c"out of memory".as_ptr());
            errdetail(c"Failed on request of size %zu in syncular.".as_ptr(), size);
            errfinish(
                c"syncular_alloc.rs".as_ptr(),
                0,
                c"syncular::alloc".as_ptr(),
            );
        }
    }
    std::ptr::null_mut()
}

/// The unit-test binary runs outside PostgreSQL (and does not link it): no session to end.
#[cfg(test)]
fn end_session(_size: usize) -> *mut u8 {
    std::ptr::null_mut()
}

/// Takes the reserve (if it is not held) and enables the FATAL path. Called from `_PG_init`.
pub fn init() {
    rearm();
    READY.store(true, Relaxed);
}

/// Takes the reserve again if a failure spent it (nothing if that fails too).
fn rearm() {
    if RESERVE_BLOCK.load(Relaxed).is_null() {
        // SAFETY: `RESERVE` has a non-zero size.
        let block = unsafe { System.alloc(RESERVE) };
        if !block.is_null() {
            RESERVE_BLOCK.store(block, Relaxed);
        }
    }
}

/// One SQL-callable function's run ([`crate::error::run`]): its generation, and the one it
/// interrupted (given back by [`Call::end`]).
pub struct Call {
    generation: u64,
    outer: u64,
}

impl Call {
    /// Starts a call: takes the reserve again if needed, and a new generation.
    #[inline]
    pub fn begin() -> Call {
        rearm();
        let generation = NEXT.fetch_add(1, Relaxed);
        Call {
            generation,
            outer: CURRENT.swap(generation, Relaxed),
        }
    }

    /// Ends the call: the size of the allocation that failed during it, if one did (the call
    /// must then end in `53200`).
    #[inline]
    pub fn end(self) -> Option<usize> {
        CURRENT.store(self.outer, Relaxed);
        (FAILED_IN.load(Relaxed) == self.generation).then(|| {
            FAILED_IN.store(0, Relaxed);
            FAILED_SIZE.load(Relaxed)
        })
    }
}

/// An allocation failed (its request size in bytes): the call ends in `53200`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfMemory(pub usize);

/// A check point: `Err` once an allocation of the running call failed (even one the reserve
/// served), so loops over input and stored data stop at once instead of running into the next
/// failure.
#[inline]
pub fn check() -> Result<(), OutOfMemory> {
    let current = CURRENT.load(Relaxed);
    if current != 0 && FAILED_IN.load(Relaxed) == current {
        return Err(OutOfMemory(FAILED_SIZE.load(Relaxed)));
    }
    Ok(())
}

/// Runs `allocate` with failures reported to it (`try_reserve` returns `Err`) instead of
/// handled by the allocator; the failure is still recorded for the running call.
fn fallible<T>(allocate: impl FnOnce() -> T) -> T {
    let outer = FALLIBLE.swap(true, Relaxed);
    let result = allocate();
    FALLIBLE.store(outer, Relaxed);
    result
}

/// Reserves room for `additional` more elements (growing as `push` does, so a loop that reserves
/// one at a time stays linear), or reports the failure.
pub fn try_reserve<T>(vec: &mut Vec<T>, additional: usize) -> Result<(), OutOfMemory> {
    if vec.capacity() - vec.len() >= additional {
        return Ok(());
    }
    fallible(|| vec.try_reserve(additional)).map_err(|_| failure::<T>(additional))
}

/// An empty vector with room for exactly `capacity` elements, or the failure.
pub fn try_with_capacity<T>(capacity: usize) -> Result<Vec<T>, OutOfMemory> {
    let mut vec = Vec::new();
    fallible(|| vec.try_reserve_exact(capacity)).map_err(|_| failure::<T>(capacity))?;
    Ok(vec)
}

/// Records a failed reservation of `count` elements (also one that never reached the allocator:
/// a size beyond `isize::MAX` is out of memory too).
fn failure<T>(count: usize) -> OutOfMemory {
    let size = count.saturating_mul(std::mem::size_of::<T>());
    record(size);
    OutOfMemory(size)
}

/// A copy of `bytes` (a value read from a row or an argument), or the failure.
pub fn try_copy(bytes: &[u8]) -> Result<Vec<u8>, OutOfMemory> {
    let mut out = try_with_capacity(bytes.len())?;
    out.extend_from_slice(bytes);
    Ok(out)
}

/// A copy of `text`, or the failure.
pub fn try_string(text: &str) -> Result<String, OutOfMemory> {
    let bytes = try_copy(text.as_bytes())?;
    // SAFETY: the bytes are a copy of a `str`, so valid UTF-8.
    Ok(unsafe { String::from_utf8_unchecked(bytes) })
}

/// `bytes` in base64 (the `engine`'s alphabet and padding), or the failure.
pub fn try_base64(engine: &impl base64::Engine, bytes: &[u8]) -> Result<String, OutOfMemory> {
    let len = base64::encoded_len(bytes.len(), true).ok_or(OutOfMemory(usize::MAX))?;
    let mut out = try_with_capacity::<u8>(len)?;
    out.resize(len, 0);
    let written = engine
        .encode_slice(bytes, &mut out)
        .map_err(|_| OutOfMemory(len))?;
    out.truncate(written);
    // SAFETY: base64 output is ASCII.
    Ok(unsafe { String::from_utf8_unchecked(out) })
}

/// `read` of the varlena `datum` detoasted by `detoast` (`pg_detoast_datum` or its `_packed`
/// variant), the detoasted copy freed after it when there is one: a reader's row loop does not
/// reset the memory context the copy is made in, so each copied value read stayed there until the
/// transaction ended (red team 37, F3; docs/SECURITY.md rule 14).
///
/// # Safety
/// `datum` must be a non-NULL varlena datum, alive for the call; `read` must not keep a pointer
/// into the varlena it is handed.
pub unsafe fn detoasted<R>(
    datum: pgrx::pg_sys::Datum,
    detoast: unsafe fn(*mut pgrx::pg_sys::varlena) -> *mut pgrx::pg_sys::varlena,
    read: impl FnOnce(*mut pgrx::pg_sys::varlena) -> R,
) -> R {
    // SAFETY: the caller's promise.
    unsafe {
        let varlena = detoast(datum.cast_mut_ptr());
        let out = read(varlena);
        if varlena != datum.cast_mut_ptr() {
            // The palloc'd copy `pg_detoast_datum_packed` made; nothing points at it any more.
            pgrx::pg_sys::pfree(varlena.cast());
        }
        out
    }
}

/// A `bytea` value of a result row, copied into Rust memory fallibly (the value may be as large
/// as whoever wrote the row made it): `db::bytes_column`. The datum is detoasted by PostgreSQL
/// (`palloc`, whose failure is its own `53200`) only when it is toasted; the one copy is Rust's.
pub struct Bytes(pub Vec<u8>);

impl pgrx::FromDatum for Bytes {
    unsafe fn from_polymorphic_datum(
        datum: pgrx::pg_sys::Datum,
        is_null: bool,
        _: pgrx::pg_sys::Oid,
    ) -> Option<Bytes> {
        if is_null {
            return None;
        }
        // SAFETY: a non-NULL bytea datum of a result row, alive while the row is read; its
        // bytes are copied out before the detoasted copy is freed.
        unsafe {
            detoasted(datum, pgrx::pg_sys::pg_detoast_datum_packed, |varlena| {
                // A failed copy reads as NULL here and is recorded: `db::bytes_column` checks at
                // once.
                try_copy(pgrx::varlena_to_byte_slice(varlena))
                    .ok()
                    .map(Bytes)
            })
        }
    }
}

impl pgrx::IntoDatum for Bytes {
    fn into_datum(self) -> Option<pgrx::pg_sys::Datum> {
        self.0.into_datum()
    }

    fn type_oid() -> pgrx::pg_sys::Oid {
        pgrx::pg_sys::BYTEAOID
    }
}

/// A `text` value of a result row, copied fallibly (see [`Bytes`]).
pub struct Text(pub String);

impl pgrx::FromDatum for Text {
    unsafe fn from_polymorphic_datum(
        datum: pgrx::pg_sys::Datum,
        is_null: bool,
        _: pgrx::pg_sys::Oid,
    ) -> Option<Text> {
        if is_null {
            return None;
        }
        // SAFETY: as for `Bytes`, for a text datum.
        unsafe {
            detoasted(datum, pgrx::pg_sys::pg_detoast_datum_packed, |varlena| {
                let text = pgrx::text_to_rust_str(varlena).expect("the database encoding is UTF-8");
                try_string(text).ok().map(Text)
            })
        }
    }
}

impl pgrx::IntoDatum for Text {
    fn into_datum(self) -> Option<pgrx::pg_sys::Datum> {
        self.0.into_datum()
    }

    fn type_oid() -> pgrx::pg_sys::Oid {
        pgrx::pg_sys::TEXTOID
    }
}

/// Unit tests (the allocator's bookkeeping) and, in a real backend after `_PG_init`
/// (`cargo pgrx test`), the reserve itself.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    #[cfg(feature = "pg_test")]
    use pgrx::prelude::*;

    /// One test, not several: the generations are process-wide and tests run in threads.
    #[test]
    fn failures_are_reported_by_the_call_they_happen_in() {
        // A request no allocator can serve: reported to the caller, recorded for the call.
        let call = Call::begin();
        assert_eq!(check(), Ok(()));
        let mut vec: Vec<u64> = Vec::new();
        assert!(try_reserve(&mut vec, usize::MAX / 16).is_err());
        assert!(check().is_err());
        assert!(call.end().is_some());
        assert_eq!(check(), Ok(()));
        // Outside every call a failure is nobody's: a later call does not report it.
        assert!(try_with_capacity::<u8>(isize::MAX as usize).is_err());
        let next = Call::begin();
        assert_eq!(check(), Ok(()));
        assert_eq!(next.end(), None);
        // A nested call (a statement of the outer one calling another function) does not
        // report the outer call's failure; the outer call does, when it ends.
        let outer = Call::begin();
        assert!(try_with_capacity::<u8>(isize::MAX as usize).is_err());
        let inner = Call::begin();
        assert_eq!(check(), Ok(()));
        assert_eq!(inner.end(), None);
        assert!(check().is_err());
        assert_eq!(outer.end(), Some(isize::MAX as usize));
    }

    #[test]
    fn copies_are_exact() {
        assert_eq!(try_copy(b"abc").unwrap(), b"abc");
        assert_eq!(try_string("é").unwrap(), "é");
        use base64::Engine;
        let engine = base64::engine::general_purpose::STANDARD;
        for n in 0..10 {
            let bytes: Vec<u8> = (0..n).collect();
            assert_eq!(try_base64(&engine, &bytes).unwrap(), engine.encode(&bytes));
        }
    }

    /// Bytes of address space the backend uses now (`/proc/self/statm`, pages).
    #[cfg(feature = "pg_test")]
    fn address_space() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
        let pages: u64 = statm.split_whitespace().next().unwrap().parse().unwrap();
        pages * 4096
    }

    /// An infallible allocation that fails (the backend's address space is exhausted) is served
    /// by the reserve, and the check point reports it: the path a call takes to `ERROR 53200`
    /// instead of an abort. The limit is lowered for the test and raised again before the end.
    #[pg_test]
    fn an_allocation_that_fails_is_served_by_the_reserve_and_reported() {
        let call = Call::begin();
        assert!(
            !RESERVE_BLOCK.load(Relaxed).is_null(),
            "the reserve is held"
        );
        let mut held: Vec<Box<[u8; 4096]>> = try_with_capacity(1 << 19).unwrap();
        let mut saved = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit with a valid resource and a valid struct pointer.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_AS, &mut saved), 0);
            let lowered = libc::rlimit {
                rlim_cur: address_space() + (16 << 20),
                rlim_max: saved.rlim_max,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &lowered), 0);
        }
        let mut reported = false;
        while held.len() < held.capacity() {
            held.push(Box::new([1u8; 4096]));
            if check().is_err() {
                reported = true;
                break;
            }
        }
        let allocated = held.len();
        drop(held);
        // SAFETY: as above; the soft limit goes back to what it was (at most the hard limit).
        unsafe {
            assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &saved), 0);
        }
        assert!(reported, "no failure after {allocated} pages of 4 KiB");
        assert!(
            RESERVE_BLOCK.load(Relaxed).is_null(),
            "the reserve was spent"
        );
        assert_eq!(call.end(), Some(4096));
        // The next call takes the reserve again.
        let next = Call::begin();
        assert!(
            !RESERVE_BLOCK.load(Relaxed).is_null(),
            "the reserve is held again"
        );
        assert_eq!(next.end(), None);
    }
}
