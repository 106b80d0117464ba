//! The pull path (docs/DESIGN.md §Pull path): [`window`] reads the commit window through the
//! inverted scope index of the log and cuts it by the delivery rule; [`bootstrap`] scans the
//! current rows of a table through the scope index of rows; [`request`] is the one-call `pull`
//! of a whole request, [`record`] its writes; [`apply`] applies on the primary what a pull served by a hot standby
//! would have written.

mod apply;
mod bootstrap;
mod budget;
mod record;
mod request;
mod window;
