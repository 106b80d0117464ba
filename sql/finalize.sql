-- Privileges: the API is SECURITY DEFINER with a pinned search_path; nobody but the owner may
-- call anything until an operator grants EXECUTE (docs/API.md, "Privileges").
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA syncular FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA syncular FROM PUBLIC;
