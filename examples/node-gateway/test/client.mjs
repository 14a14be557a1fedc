// A user's socket in its own process: connects to the example gateway as
// USER/SESSION (in ROOM), answers pings (as every browser does), prints
// "registered" once the gateway has registered it (and "room ROOM: MEMBERS"
// for each list of its room's members the gateway relays), and then lives
// until it is stopped (SIGSTOP: a laptop that went to sleep, no close frame)
// or killed.
import WebSocket from "ws";

const url = new URL("/ws", process.env.GATEWAY_URL);
url.search = new URLSearchParams({ user: process.env.USER_ID, session: process.env.SESSION_ID, room: process.env.ROOM_ID ?? "" }).toString();
const ws = new WebSocket(url);
ws.on("message", (data) => {
  const message = JSON.parse(data.toString());
  if (message.type === "registered") console.log("registered");
  if (message.type === "room") console.log(`room ${message.roomId}: ${message.members.join(",")}`);
});
ws.on("close", (code) => {
  console.log(`closed ${code}`);
  process.exit(0);
});
// A tab closing: a close frame, then the process ends on the close.
process.on("SIGTERM", () => ws.close(1000, "tab closed"));
