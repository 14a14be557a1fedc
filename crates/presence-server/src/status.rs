//! The one table from store errors to gRPC statuses.

use presence_core::LeaseError;
use tonic::Status;

/// Maps a store refusal to the status api.md promises for it.
pub(crate) fn status_of(err: LeaseError) -> Status {
    match &err {
        LeaseError::InvalidArgument { .. } => Status::invalid_argument(err.to_string()),
        LeaseError::NotFound { .. } => Status::not_found(err.to_string()),
        LeaseError::StaleGeneration { .. } => Status::failed_precondition(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_refusal_has_its_code() {
        let invalid = LeaseError::InvalidArgument { field: "user_id", reason: "must not be empty".into() };
        let status = status_of(invalid);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "user_id: must not be empty");
        let not_found = LeaseError::NotFound { user_id: "u".into(), session_id: "s".into() };
        assert_eq!(status_of(not_found).code(), Code::NotFound);
        let stale = LeaseError::StaleGeneration { user_id: "u".into(), session_id: "s".into(), given: 1, current: 2 };
        assert_eq!(status_of(stale).code(), Code::FailedPrecondition);
    }
}
