//! The DNS query redirector writes wherever it asks a server itself (the health probes; the
//! tests' clients too): a standard query with recursion desired.

use hickory_proto::op::{Message, MessageType, OpCode, Query};

/// A standard query for `query` with ID `id` and recursion desired; the caller adds EDNS if it
/// wants it, and encodes.
#[must_use]
pub fn recursive_query(id: u16, query: Query) -> Message {
    let mut message = Message::new();
    message
        .set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(query);
    message
}
