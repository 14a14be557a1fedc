//! O1 for rooms: the store's counts of rooms and memberships, which the
//! server exports as gauges.

use presence_core::{Changes, Registration, RoomAccess, RoomRef, Store, StoreConfig};

#[test]
fn o1_rooms_and_memberships_are_counted_as_they_come_and_go() {
    let store = Store::new(StoreConfig::default(), 1_000).unwrap();
    let mut changes = Changes::default();
    let mut generations = Vec::new();
    for (user, session) in [("a", "s1"), ("a", "s2"), ("b", "s")] {
        let registration =
            Registration { user_id: user, session_id: session, gateway_id: "g", ttl_ms: 0, metadata: &[] };
        generations.push(store.register(1_000, &registration, &mut changes).unwrap().generation);
    }
    let room = |user, session, generation, room_id| RoomRef { user_id: user, session_id: session, generation, room_id };
    store.join(1_000, &room("a", "s1", generations[0], "x"), &[], &mut changes).unwrap();
    store.join(1_000, &room("a", "s2", generations[1], "x"), &[], &mut changes).unwrap();
    store.join(1_000, &room("b", "s", generations[2], "x"), &[], &mut changes).unwrap();
    store.join(1_000, &room("b", "s", generations[2], "y"), &[], &mut changes).unwrap();
    let stats = store.stats();
    assert_eq!((stats.rooms, stats.room_memberships), (2, 3), "a second tab is not a second membership");
    store.leave(1_000, &room("b", "s", generations[2], "y"), &mut changes).unwrap();
    store.set_room_access("z", RoomAccess::Public).unwrap();
    let stats = store.stats();
    assert_eq!((stats.rooms, stats.room_memberships), (2, 2), "y emptied and went; z is kept for its access");
}
